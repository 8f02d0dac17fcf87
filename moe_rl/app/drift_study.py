"""Drift versus sequence length: K3 between the rollout (inference) copy and the trainer on the
token-sequence env, for one mismatch source, at each sequence length.

Each length runs the real system: rollout actors sample episodes with the inference copy, the
learner group computes its view, the consistency actor measures (no update is needed).
    moe-rl drift-study --source bf16 --lengths 64,128,256,512,1024 --output runs/drift
    moe-rl drift-study --checkpoint RUN_DIR ...   # the trained policy of a token run
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import gymnasium as gym
import numpy as np
import ray
from ray.rllib.core import DEFAULT_MODULE_ID

import moe_rl.envs  # noqa: F401  registers moe_rl/ envs
from moe_rl.algo.algorithm import MoEPPOConfig
from moe_rl.algo.results import write_table
from moe_rl.app.checkpoint import load_policy
from moe_rl.app.evaluate import load_run
from moe_rl.app.plots import line_plot_svg
from moe_rl.core.errors import ConfigError
from moe_rl.core.sharding import unstack_experts

TOKEN_ENV = "moe_rl/TokenSequence-v0"
K3_FLOOR = 1e-16   # plots: K3 on a log axis (float rounding sits near 1e-15)

# source -> (moe settings, learners). "deepspeed": fp32 and dropless at both ends, but the trainer
# runs DeepSpeed's MoE layer (its gate, einsum dispatch and combine, all-to-all over 2 ranks) where
# the rollout copy runs moe-rl's own: a kernel-level difference only.
SOURCES = {
    "none": ({}, 0),
    "bf16": ({"inference_dtype": "bf16"}, 0),
    "deepspeed": ({"ep_size": 2}, 2),
    "capacity": ({"trainer_capacity_factor": 1.0, "ep_size": 2}, 2),
    "second_expert": ({"trainer_second_expert_sampling": True, "ep_size": 2}, 2),
}


def study_config(seq_len: int, source: str, seed: int, prompt_len: int = 8, run_cfg: Optional[dict] = None):
    """One episode of seq_len tokens. run_cfg (a trained run's config.yaml): its model and env at
    this length; else an untrained policy (d 32, 8 experts top-2) on an 8-token vocabulary."""
    moe, learners = SOURCES[source]
    if run_cfg is None:
        env_config = {"seq_len": seq_len, "prompt_len": prompt_len, "vocab_size": 8}
        model = {"num_experts": 8, "top_k": 2, "d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2,
                 "max_seq_len": seq_len + prompt_len}
    else:
        env_config = {**run_cfg["env_config"], "seq_len": seq_len}
        prompt_len = env_config["prompt_len"]
        model = run_cfg["moe"]
    top = seq_len + prompt_len
    bins = sorted({b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < top} | {top})
    return (MoEPPOConfig()
            .environment(TOKEN_ENV, env_config=env_config)
            .env_runners(num_env_runners=1, num_envs_per_env_runner=1)
            .training(train_batch_size_per_learner=seq_len, minibatch_size=seq_len, num_epochs=1)
            .learners(num_learners=learners)
            .moe(**{**model, "routing_replay": False, **moe})   # the raw mismatch: no remedy
            .consistency(sample_size=min(seq_len, 128), probe_size=4, position_bins=bins,
                         thresholds={"probe_flip_rate": 1.0})
            .debugging(seed=seed))


def trained_policy(run_dir: str, lengths: List[int], trust_env_code: Optional[bool] = None,
                   trust_run: bool = False) -> Tuple[dict, Dict[str, np.ndarray]]:
    """A token run's config and its newest good checkpoint's policy (canonical names). The value
    network is left out: its input is the whole observation, so its size follows the length."""
    cfg, ckpt, signed = load_run(run_dir, "--checkpoint", trust_env_code, trust_run)
    if cfg.get("env") != TOKEN_ENV or cfg.get("multi_agent"):
        raise ConfigError(f"--checkpoint: must be a single-agent run on {TOKEN_ENV}, got {cfg.get('env')!r}")
    longest = max(lengths) + cfg["env_config"]["prompt_len"]
    if cfg["moe"].get("positions", "learned") == "learned" and longest > cfg["moe"]["max_seq_len"]:
        raise ConfigError(f"--lengths: the run's policy has learned positions up to moe.max_seq_len="
                          f"{cfg['moe']['max_seq_len']} tokens (prompt included), got {longest}; train with "
                          f"moe.positions: relative (configs/tokens_long.yaml) to study any length")
    env = gym.make(TOKEN_ENV, **cfg["env_config"])
    module = load_policy(ckpt, cfg, env.observation_space, env.action_space, require_signature=signed)
    state = {k: v.detach().numpy() for k, v in unstack_experts(module.state_dict()).items() if not k.startswith("vf")}
    return cfg, state


def load_trained_policy(algo, policy: Dict[str, np.ndarray]) -> None:
    """The trained policy into the learners (every rank its own experts), then to the rollouts."""
    full = algo.learner_group.module_state(inference_only=False)[DEFAULT_MODULE_ID]
    missing = sorted(k for k in full if not k.startswith("vf") and k not in policy)
    if missing or any(policy[k].shape != full[k].shape for k in policy):
        raise ConfigError(f"--checkpoint: the policy does not fit the study's model (missing {missing[:3]})")
    full.update(policy)
    algo.learner_group.load_shards([ray.put({DEFAULT_MODULE_ID: full})], inference_only=False)
    algo._sync_rollout_weights()


def measure(seq_len: int, source: str, seed: int, run_cfg=None, policy=None) -> Dict:
    algo = study_config(seq_len, source, seed, run_cfg=run_cfg).build_algo()
    try:
        if policy is not None:
            load_trained_policy(algo, policy)
        episodes = algo.collect(algo.training_plan())
        algo.sync_gate.before_update(episodes, algo.iteration)
        algo.sync_gate.after_update(algo.iteration)
        row = algo.sync_gate.ledger()[-1]
    finally:
        algo.stop()
    if "k3" not in row:
        raise RuntimeError(f"drift study: the check at seq_len {seq_len} (source {source}, seed {seed}) measured "
                           f"nothing: {({k: v for k, v in row.items() if k != 'k3_by_position'})}")
    return {"seq_len": seq_len, "source": source, "seed": seed, "k3": row["k3"], "k1": row["k1"],
            "max_abs_logp_diff": row["max_abs_logp_diff"], "routing_agreement": row["routing_agreement"],
            "episode_return": float(np.mean([e.get_return() for e in episodes if e.is_done] or [np.nan])),
            "k3_by_position": row.get("k3_by_position", "{}")}


def _mean_std(values: List[float]) -> Tuple[float, float]:
    return float(np.mean(values)), float(np.std(values))


def run_study(lengths: List[int], source: str, seeds: List[int], output: str,
              trained: Optional[Tuple[dict, Dict[str, np.ndarray]]] = None) -> List[Dict]:
    """Needs a running Ray (the CLI starts one). trained: trained_policy(RUN_DIR), measured
    instead of an untrained policy."""
    run_cfg, policy = trained or (None, None)
    os.makedirs(output, exist_ok=True)
    rows = []
    for L in lengths:
        for seed in seeds:
            rows.append(measure(L, source, seed, run_cfg, policy))
            r = rows[-1]
            print(f"seq_len {L:5d} seed {seed}: K3 {r['k3']:.3e}  max|dlogp| {r['max_abs_logp_diff']:.3e}  "
                  f"routing agreement {r['routing_agreement']:.3f}  return {r['episode_return']:.3f}", flush=True)
    write_table(os.path.join(output, "drift_study.parquet"), rows)
    summary = []
    print(f"\nBy sequence length ({source}; mean ± std over seeds):\n"
          f"  seq_len   K3                     routing agreement   max|dlogp|   return")
    for L in lengths:
        at = [r for r in rows if r["seq_len"] == L]
        (k3, k3_std), (agree, agree_std) = (_mean_std([r[f] for r in at]) for f in ("k3", "routing_agreement"))
        summary.append((L, k3))
        print(f"  {L:7d}  {k3:9.3e} ± {k3_std:9.3e}  {agree:.4f} ± {agree_std:.4f}   "
              f"{max(r['max_abs_logp_diff'] for r in at):9.3e}   {np.nanmean([r['episode_return'] for r in at]):.3f}")
    by_pos = {}
    for r in rows:
        for b, v in json.loads(r["k3_by_position"]).items():
            by_pos.setdefault(f"seq_len {r['seq_len']}", []).append((int(b), v))
    with open(os.path.join(output, "drift_study.svg"), "w") as f:
        f.write(line_plot_svg({"mean K3": summary}, f"K3 vs sequence length ({source})", "sequence length",
                              "K3", log_x=True, log_y_floor=K3_FLOOR))
    with open(os.path.join(output, "drift_by_position.svg"), "w") as f:
        f.write(line_plot_svg({k: sorted(v) for k, v in by_pos.items()}, f"K3 by position ({source})",
                              "position (upper bin edge)", "K3", log_x=True, log_y_floor=K3_FLOOR))
    return rows

"""Drift versus sequence length: K3 between the rollout (inference) copy and the trainer on the
token-sequence env, for one mismatch source, at each sequence length.

Each length runs the real system: rollout actors sample episodes with the inference copy, the
learner group computes its view, the consistency actor measures (no update is needed).
    moe-rl drift-study --source bf16 --lengths 64,128,256,512,1024 --output runs/drift
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

from moe_rl.algo.algorithm import MoEPPOConfig
from moe_rl.algo.results import write_table
from moe_rl.app.plots import line_plot_svg

SOURCES = {
    "none": ({}, 0),
    "bf16": ({"inference_dtype": "bf16"}, 0),
    "capacity": ({"trainer_capacity_factor": 1.0, "ep_size": 2}, 2),
    "second_expert": ({"trainer_second_expert_sampling": True, "ep_size": 2}, 2),
}


def study_config(seq_len: int, source: str, seed: int, prompt_len: int = 8):
    moe, learners = SOURCES[source]
    top = seq_len + prompt_len
    bins = sorted({b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < top} | {top})
    return (MoEPPOConfig()
            .environment("moe_rl/TokenSequence-v0", env_config={"seq_len": seq_len, "prompt_len": prompt_len,
                                                                "vocab_size": 8})
            .env_runners(num_env_runners=1, num_envs_per_env_runner=1)
            .training(train_batch_size_per_learner=seq_len, minibatch_size=seq_len, num_epochs=1)
            .learners(num_learners=learners)
            .moe(**{"num_experts": 8, "top_k": 2, "d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2,
                    "max_seq_len": seq_len + prompt_len, **moe})
            .consistency(sample_size=min(seq_len, 128), probe_size=4, position_bins=bins,
                         thresholds={"probe_flip_rate": 1.0})
            .debugging(seed=seed))


def measure(seq_len: int, source: str, seed: int) -> Dict:
    algo = study_config(seq_len, source, seed).build_algo()
    try:
        episodes = algo._sample()
        algo.sync_gate.before_update(episodes)
        algo.sync_gate.after_update()
        row = algo.sync_gate.rows[-1]
    finally:
        algo.stop()
    return {"seq_len": seq_len, "source": source, "seed": seed, "k3": row["k3"], "k1": row["k1"],
            "max_abs_logp_diff": row["max_abs_logp_diff"], "routing_agreement": row["routing_agreement"],
            "k3_by_position": row.get("k3_by_position", "{}")}


def run_study(lengths: List[int], source: str, seeds: List[int], output: str) -> List[Dict]:
    """Needs a running Ray (the CLI starts one)."""
    os.makedirs(output, exist_ok=True)
    rows = []
    for L in lengths:
        for seed in seeds:
            rows.append(measure(L, source, seed))
            r = rows[-1]
            print(f"seq_len {L:5d} seed {seed}: K3 {r['k3']:.3e}  max|dlogp| {r['max_abs_logp_diff']:.3e}  "
                  f"routing agreement {r['routing_agreement']:.3f}", flush=True)
    write_table(os.path.join(output, "drift_study.parquet"), rows)
    summary = []
    print(f"\nK3 by sequence length ({source}):\n  seq_len   mean K3     std K3   max|dlogp|")
    for L in lengths:
        ks = [r["k3"] for r in rows if r["seq_len"] == L]
        mean = sum(ks) / len(ks)
        std = (sum((k - mean) ** 2 for k in ks) / len(ks)) ** 0.5
        dl = max(r["max_abs_logp_diff"] for r in rows if r["seq_len"] == L)
        summary.append((L, mean))
        print(f"  {L:7d}  {mean:9.3e}  {std:9.3e}  {dl:9.3e}")
    by_pos = {}
    for r in rows:
        for b, v in json.loads(r["k3_by_position"]).items():
            by_pos.setdefault(f"seq_len {r['seq_len']}", []).append((int(b), v))
    with open(os.path.join(output, "drift_study.svg"), "w") as f:
        f.write(line_plot_svg({"mean K3": summary}, f"K3 vs sequence length ({source})", "sequence length",
                              "K3", log_x=True))
    with open(os.path.join(output, "drift_by_position.svg"), "w") as f:
        f.write(line_plot_svg({k: sorted(v) for k, v in by_pos.items()}, f"K3 by position ({source})",
                              "position (upper bin edge)", "K3", log_x=True))
    return rows

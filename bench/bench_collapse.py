"""Collapse experiment: a genuine training-inference mismatch switched on, and each remedy.

    .venv/bin/python bench/bench_collapse.py [--source capacity|capacity_half|bf16] [--seeds 5] [--iterations 20]
        [--arms none,tis,rs_veto,r3,routing_rs,hold] [--json OUT]

Task: configs/tokens.yaml (copy an 8-token prompt, vocabulary 4, the transformer trunk with MoE
feed-forward layers; random policy 0.25), made harsher (lr 3e-3, batch 1000) so that a mismatch has
room to hurt. Mismatch sources:
  capacity  capacity factor 1.0 at both ends without routing replay. Until 2026-12-01 the token
            trunk's capacity group was the whole batch (8 sequences at rollout, 250 in training), a
            genuine mismatch; each sequence is its own group now, so this source measures that the
            two ends agree (routing agreement 1.0)
  capacity_half  the same at capacity factor 0.5 (about half of the assignments dropped)
  bf16      the rollout copy in bf16, the trainer in fp32
Arms (each on top of the source):
  none        no correction
  tis         token-level truncated importance sampling (consistency.correction.preset token_is)
  rs_veto     token IS + token rejection + a veto of sequences with a token ratio below 1e-4
  r3          routing replay (moe.routing_replay true)
  routing_rs  reject tokens whose top-k differs between rollout and trainer in any layer
  hold        the sync gate under `hold` (a bad update is not synced, the learner retries)

Collapse (defined before any run): a non-finite loss, or, after the mean return reached 0.5, the
last 3 iterations all below 60 % of the best. Reported per arm: collapses, final return, iterations
to a return of 0.8, and the worst K3 and routing agreement of the run's consistency checks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from moe_rl.algo.results import metrics_row  # noqa: E402
from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, COLLAPSE_FROM, COLLAPSE_SHARE = 0.8, 0.5, 0.6
HARSH = ["training.lr=0.003", "training.train_batch_size_per_learner=1000", "stop_return=null"]
SOURCES = {"capacity": ["moe.capacity_factor=1.0", "moe.routing_replay=false"],
           "capacity_half": ["moe.capacity_factor=0.5", "moe.routing_replay=false"],
           "bf16": ["moe.inference_dtype=bf16", "moe.routing_replay=false"]}
ARMS = {
    "none": [],
    "tis": ["consistency.correction.preset=token_is"],
    "rs_veto": ["consistency.correction.preset=token_is_rs", "consistency.correction.veto_threshold=0.0001"],
    "r3": ["moe.routing_replay=true"],
    "routing_rs": ["consistency.correction.preset=routing_rs"],
    "hold": ["consistency.policy=hold"],
}


def collapsed(returns, losses_finite: bool) -> bool:
    if not losses_finite:
        return True
    seen = [r for r in returns if math.isfinite(r)]
    best = max(seen, default=0.0)
    return best >= COLLAPSE_FROM and len(seen) >= 3 and all(r < COLLAPSE_SHARE * best for r in seen[-3:])


def run(source: str, arm: str, seed: int, iterations: int):
    cfg = apply_overrides(load_run_config(os.path.join(HERE, "configs/tokens.yaml")),
                          [*HARSH, *SOURCES[source], *ARMS[arm], f"seed={seed}"])
    algo = validate_run_config(cfg).build_algo()
    rows, error = [], None
    try:
        for _ in range(iterations):
            rows.append(metrics_row(algo.train()))
        checks = algo.sync_gate.ledger()
    except Exception as e:  # noqa: BLE001  a run that raises counts as collapsed, with its reason
        error, checks = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", []
    finally:
        algo.stop()
    returns = [r["episode_return_mean"] for r in rows]
    finite = error is None and all(math.isfinite(r.get(k, 0.0)) for r in rows for k in ("policy_loss", "vf_loss"))
    return {"source": source, "arm": arm, "seed": seed, "returns": returns, "error": error,
            "collapsed": collapsed(returns, finite),
            "final_return": next((x for x in reversed(returns) if math.isfinite(x)), float("nan")),
            "iterations_to_target": next((i + 1 for i, x in enumerate(returns) if x >= TARGET), None),
            "max_k3": max((abs(c["k3"]) for c in checks), default=float("nan")),
            "min_routing_agreement": min((c["routing_agreement"] for c in checks), default=float("nan")),
            "held": sum(c.get("decision") == "hold" for c in checks),
            "rejected_share": statistics.mean([r.get("correction/rejected_fraction", 0.0) for r in rows] or [0.0])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", choices=tuple(SOURCES), default="capacity")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: {bad[0]!r} is not one of {tuple(ARMS)}")
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=2)
    out, t0 = [], time.time()
    try:
        for seed in range(args.seeds):
            for arm in arms:
                r = run(args.source, arm, seed, args.iterations)
                out.append(r)
                print(f"{arm:10s} seed {seed}: collapsed={r['collapsed']} final {r['final_return']:.3f} "
                      f"to_{TARGET}={r['iterations_to_target']} K3<={r['max_k3']:.1e} "
                      f"agreement>={r['min_routing_agreement']:.3f} held={r['held']} "
                      f"rejected={r['rejected_share']:.3f} {r['error'] or ''} ({time.time() - t0:.0f}s)", flush=True)
    finally:
        ray.shutdown()
    for arm in arms:
        mine = [r for r in out if r["arm"] == arm]
        reach = [r["iterations_to_target"] for r in mine if r["iterations_to_target"] is not None]
        fin = [r["final_return"] for r in mine]
        print(f"{arm:10s} collapsed {sum(r['collapsed'] for r in mine)}/{len(mine)}  final "
              f"{statistics.mean(fin):.3f} ± {statistics.pstdev(fin):.3f}  reached {TARGET} {len(reach)}/{len(mine)}"
              f"{f' in {statistics.mean(reach):.1f} iterations' if reach else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Routing consistency and routing replay on the quickstart (CartPole, 8 experts top-2, fp32 copy).

    .venv/bin/python bench/bench_routing.py [--arms default,r3,mismatched,bf16,bf16_r3,bf16_mismatched,...]
        [--seeds 0,1,2] [--iterations 8] [--set KEY=VALUE ...] [--json OUT]

Per arm and seed: the return at every iteration, the worst routing agreement and K3 of the
consistency checks (rollout copy vs the learner at the same weights), the learner's CV and
`moe/replay_divergence` (how far the router's own choice left the replayed experts) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from moe_rl.algo.results import metrics_row  # noqa: E402
from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {
    "default": [],
    "r3": ["moe.routing_replay=true"],
    "r3_aux0": ["moe.routing_replay=true", "moe.aux_loss_coef=0.0"],
    "mismatched": ["moe.routing_replay=mismatched"],
    "bf16": ["moe.inference_dtype=bf16", "moe.routing_replay=false"],
    "bf16_r3": ["moe.inference_dtype=bf16", "moe.routing_replay=true"],
    "bf16_mismatched": ["moe.inference_dtype=bf16", "moe.routing_replay=mismatched"],
    "sinkhorn": ["moe.router=sinkhorn"],
    "reinforce": ["moe.router=reinforce"],
    "capacity": ["moe.capacity_factor=1.0"],
    "bias": ["moe.router=bias"],
}


def run(arm: str, seed: int, iterations: int, overrides=()):
    cfg = apply_overrides(load_run_config(os.path.join(HERE, "configs/cartpole.yaml")),
                          [*overrides, *ARMS[arm], f"seed={seed}", "stop_return=null"])
    algo = validate_run_config(cfg).build_algo()
    returns, rows = [], []
    try:
        for _ in range(iterations):
            r = algo.train()
            rows.append(metrics_row(r))
            returns.append(rows[-1]["episode_return_mean"])
        checks = algo.sync_gate.ledger()
    finally:
        algo.stop()
    return {"arm": arm, "seed": seed, "returns": returns,
            "min_routing_agreement": min(c["routing_agreement"] for c in checks),
            "max_k3": max(abs(c["k3"]) for c in checks),
            "cv_end": rows[-1].get("moe/cv"), "min_util_end": rows[-1].get("moe/min_util"),
            "health_end": rows[-1].get("moe/health"), "replay_divergence_end": rows[-1].get("moe/replay_divergence"),
            "replayed_fraction": [r.get("replay/replayed_fraction") for r in rows]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every arm, e.g. training.num_epochs=1")
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=4)
    out = []
    try:
        for arm in args.arms.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                r = run(arm, seed, args.iterations, args.set)
                out.append(r)
                print(f"{arm:10s} seed {seed}: returns {[round(x) for x in r['returns']]}  agreement >= "
                      f"{r['min_routing_agreement']:.3f}  K3 <= {r['max_k3']:.1e}  cv {r['cv_end']:.2f}  "
                      f"min util {r['min_util_end']:.3f}  health {r['health_end']}  "
                      f"replay divergence {r['replay_divergence_end']:.2f}", flush=True)
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

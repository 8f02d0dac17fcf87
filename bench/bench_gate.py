"""The sync gate: no false positives on healthy runs, and every injected fault caught and survived.

    .venv/bin/python bench/bench_gate.py healthy [--configs cartpole,multitask,tokens,cartpole_ep2,cartpole_bf16]
        [--seeds 0,1,2,3,4] [--iterations 25] [--json OUT]
    .venv/bin/python bench/bench_gate.py faults [--policies warn,hold,rollback] [--iterations 20]
        [--inject-at 8] [--faults a,b,c,d,e] [--json OUT]

healthy: each config and seed trains under policy `warn`, which records every check's decision
without changing the run; a check that would hold or roll back under the other policies is a
`warn` row there, so the count of gate actions under warn is the count under hold and rollback.
Seed 0 is also trained under hold and rollback to show the same final return.

faults: each fault of moe_rl.algo.faults is injected before iteration `inject_at` + 1 on the
quickstart (local learner: a-c) or its 2-learner ep_size 2 DeepSpeed version (d, e), under each
policy. Reported: the check that caught it (its iteration and cause), the actions, and the final
return (mean of the last 5 iterations) against the uninjected run of the same config and seed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from moe_rl.algo import faults  # noqa: E402
from moe_rl.algo.sync_gate import GateStop  # noqa: E402
from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "cartpole": ("configs/cartpole.yaml", []),
    "multitask": ("configs/multitask.yaml", []),
    "tokens": ("configs/tokens.yaml", []),
    "cartpole_ep2": ("configs/cartpole.yaml", ["learners.num_learners=2", "moe.ep_size=2"]),
    # a bf16 rollout copy: a same-weights mismatch on every check, reported, never acted on
    "cartpole_bf16": ("configs/cartpole.yaml", ["moe.inference_dtype=bf16"]),
}
FAULTS = {  # name -> (config, fault factory or extra overrides)
    "a_corrupt_copy": ("cartpole", lambda: faults.CorruptRolloutCopy(delta=0.5)),
    "b_nonfinite_candidate": ("cartpole", lambda: faults.NonFiniteCandidate()),
    "c_harmful_update": ("cartpole", lambda: faults.HarmfulUpdate(factor=1000)),
    "d_replica_perturbed": ("cartpole_ep2", lambda: faults.PerturbReplica(rank=1, delta=0.01)),
    "e_bf16_capacity_mismatch": ("cartpole_ep2", ["moe.inference_dtype=bf16", "moe.trainer_capacity_factor=1.0"]),
}


def build(name: str, seed: int, policy: str, extra=()):
    path, overrides = CONFIGS[name]
    cfg = apply_overrides(load_run_config(os.path.join(HERE, path)),
                          [*overrides, *extra, f"seed={seed}", "stop_return=null", f"consistency.policy={policy}"])
    return validate_run_config(cfg).build_algo()


def train(algo, iterations: int, inject_at=None, fault=None):
    returns, alerts, t0 = [], [], time.perf_counter()
    stopped = None
    for i in range(iterations):
        if i == inject_at and fault is not None:
            faults.inject(algo, fault)
        try:
            r = algo.train()
        except GateStop as e:
            stopped = str(e)
            break
        returns.append(float(r["env_runners"].get("episode_return_mean", float("nan"))))
        alerts += [f"{a['iteration']}:{a['metric']}:{a['kind']}" for a in r.get("moe_rl_alerts", [])]
    rows = algo.sync_gate.ledger()
    return {"returns": returns, "final_return": sum(returns[-5:]) / len(returns[-5:]),
            "rows": [{k: r.get(k) for k in ("iteration", "decision", "cause", "action", "reason", "lag_versions",
                                             "k3", "routing_agreement")} for r in rows],
            # a mismatch `report` changes nothing; the count is of checks that held, rolled back or repaired
            "actions": sum(1 for r in rows if set((r.get("action") or "report").split(";")) - {"report"}),
            "stopped": stopped, "alerts": alerts,
            "wall_s": time.perf_counter() - t0}


def healthy(args):
    out = []
    for name in args.configs.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            for policy in ("warn", "hold", "rollback") if seed == 0 else ("warn",):
                algo = build(name, seed, policy)
                try:
                    r = train(algo, args.iterations)
                finally:
                    algo.stop()
                acted = [(x["iteration"], x["action"], x["reason"]) for x in r["rows"]
                         if x["action"] and x["action"] != "report"]
                causes = sorted({x["cause"] for x in r["rows"] if x["cause"]})
                print(f"{name:13s} seed {seed} {policy:8s} actions {r['actions']:2d}  causes {causes}  "
                      f"final return {r['final_return']:7.1f}  alerts {r['alerts']}  ({r['wall_s']:.0f}s) {acted[:3]}",
                      flush=True)
                out.append({"config": name, "seed": seed, "policy": policy, **{k: r[k] for k in (
                    "actions", "final_return", "returns", "stopped", "alerts")}, "acted": acted, "causes": causes})
    return out


def fault_matrix(args):
    out, baselines = [], {}
    for fault, (name, what) in FAULTS.items():
        if args.faults and not fault.startswith(tuple(args.faults.split(","))):
            continue
        if name not in baselines:
            algo = build(name, 0, "warn")
            try:
                baselines[name] = train(algo, args.iterations)["final_return"]
            finally:
                algo.stop()
            print(f"baseline {name}: final return {baselines[name]:.1f}", flush=True)
        for policy in args.policies.split(","):
            extra = what if isinstance(what, list) else []
            algo = build(name, 0, policy, extra)
            try:
                r = train(algo, args.iterations, args.inject_at, None if extra else what())
            finally:
                algo.stop()
            first = next((x for x in r["rows"] if x["iteration"] > args.inject_at and x["cause"]), None) \
                if not extra else next((x for x in r["rows"] if x["cause"]), None)
            caught = None if first is None else {"iteration": first["iteration"], "cause": first["cause"],
                                                 "action": first["action"], "reason": (first["reason"] or "")[:160]}
            actions = sorted({a for x in r["rows"] for a in (x["action"] or "").split(";") if a})
            ratio = r["final_return"] / baselines[name] if baselines[name] else float("nan")
            print(f"{fault:26s} {policy:8s} caught {caught and (caught['iteration'], caught['cause'])}  actions "
                  f"{actions}  final {r['final_return']:6.1f} ({ratio:.2f}x baseline)"
                  f"{'  STOPPED' if r['stopped'] else ''}", flush=True)
            out.append({"fault": fault, "config": name, "policy": policy, "caught": caught, "actions": actions,
                        "final_return": r["final_return"], "baseline": baselines[name], "ratio": ratio,
                        "stopped": r["stopped"], "returns": r["returns"]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("healthy", "faults"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--policies", default="warn,hold,rollback")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--inject-at", type=int, default=8)
    ap.add_argument("--faults", default="", help="comma-separated prefixes (a,b,...): only these faults")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.iterations = args.iterations or (25 if args.mode == "healthy" else 20)
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=6)
    try:
        result = healthy(args) if args.mode == "healthy" else fault_matrix(args)
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Stability benchmark: a stress config over many seeds with the stability toolkit off and on.

    .venv/bin/python bench/bench_stability.py [--seeds 10] [--iterations 20] [--nan-rate 0.0]
        [--arms both|on|off] [--on-aux 0.05] [--on-z 0.001]
        [--on-router topk] [--on-balance fixed|adaptive] [--json OUT]

Stress: CartPole-v1, 32 experts top-2, aggressive Adam LR (3e-3), small batches (512 steps,
minibatch 64, 6 epochs). With --nan-rate r, each optimizer step's gradient
is made non-finite with probability r on purpose (the seeds' "ghost" NaN gradients of mixed precision).

Toolkit off: plain Adam steps (no clipping, no skipping), no load-balancing or z loss.
Toolkit on: the seeds' recipe — load-balancing loss 0.05 and z loss 1e-3, per-group clipping
(base 1.0: router 0.5, experts 3.0, ...), NaN-step skipping, winsorizing at p=0.01, a router LR of
1/10 with a linear warm-up, cosine decay for the experts.

A run crashes when (1) any loss or the return is non-finite or the run raises, (2) the router
collapses: active experts < 50% of N or CV > 2 for 5 consecutive iterations, or (3) the return
collapses: after reaching >= 100 it stays below 30% of its best for the last 3 iterations.
Reported per arm: crash rate, iterations to a return of 200, final return (mean over non-crashed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.algo.results import metrics_row  # noqa: E402

EXPERTS, LR, THRESHOLD = 32, 3e-3, 200.0
# Each arm: (moe settings, stability settings). "on" is everything moe-rl offers against instability:
# the load-balancing and z losses, and the stability toolkit.
TOOLKIT_ON_MOE = {"aux_loss_coef": 0.05, "z_loss_coef": 0.001}
TOOLKIT_OFF_MOE = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0}
TOOLKIT_ON = {"grad_clip": 1.0, "skip_nonfinite": True, "winsorize_p": 0.01,
              "lr_schedules": {"router": {"schedule": "constant", "lr": LR / 10, "warmup_steps": 50},
                               "experts": {"schedule": "cosine", "lr": LR, "eta_min": LR / 10, "t_max": 2000}}}
TOOLKIT_OFF = {"skip_nonfinite": False, "anomaly_detection": False}


def nan_injector(rate: float, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def hook(learner, module_id):
        if torch.rand((), generator=gen).item() < rate:
            p = next(p for p in learner.module[module_id].parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")
    return hook


def config(seed: int, toolkit: bool) -> MoEPPOConfig:
    return (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=4)
            .training(lr=LR, train_batch_size_per_learner=512, minibatch_size=64, num_epochs=6,
                      vf_loss_coeff=0.5, vf_clip_param=1000.0)
            .moe(num_experts=EXPERTS, top_k=2, num_layers=2, d_model=64, d_ff=64,
                 **(TOOLKIT_ON_MOE if toolkit else TOOLKIT_OFF_MOE))
            .stability(**(TOOLKIT_ON if toolkit else TOOLKIT_OFF))
            .debugging(seed=seed))


def crashed(rows):
    # The return is NaN in an iteration where no episode ended (long CartPole episodes, small
    # batches): that is not a crash, so only losses count as non-finite, and returns are filtered.
    for r in rows:
        if not all(math.isfinite(r.get(k, 0.0)) for k in ("policy_loss", "vf_loss", "aux_loss")):
            return "non-finite"
    bad = 0
    for r in rows:
        bad = bad + 1 if (r["moe/active_experts"] < 0.5 * EXPERTS or r["moe/cv"] > 2.0) else 0
        if bad >= 5:
            return "router-collapse"
    returns = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
    if returns and max(returns) >= 100 and len(returns) >= 3 and all(v < 0.3 * max(returns) for v in returns[-3:]):
        return "return-collapse"
    return None


def one_run(seed: int, toolkit: bool, iterations: int, nan_rate: float):
    algo = config(seed, toolkit).build_algo()
    rows, error = [], None
    if nan_rate > 0:
        algo.learner_group.foreach_learner(lambda l: l.grad_hooks.append(nan_injector(nan_rate, seed)))
    try:
        for _ in range(iterations):
            rows.append(metrics_row(algo.train()))
            if crashed(rows) == "non-finite":
                break
    except Exception as e:  # noqa: BLE001  a run that raises is a crash, recorded with its reason
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        algo.stop()
    reason = "exception" if error else crashed(rows)
    to_threshold = next((r["iteration"] for r in rows if r["episode_return_mean"] >= THRESHOLD), None)
    return {"seed": seed, "toolkit": toolkit, "crash": reason, "error": error, "iterations": len(rows),
            "iterations_to_threshold": to_threshold,
            "final_return": next((r["episode_return_mean"] for r in reversed(rows)
                                  if math.isfinite(r["episode_return_mean"])), float("nan")),
            "skipped_steps": rows[-1].get("stability/skipped_steps", 0.0) if rows else 0.0}


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def summary(runs, toolkit):
    """Crash rate; convergence over every run of the arm (a router collapse need not stop learning)."""
    arm = [r for r in runs if r["toolkit"] == toolkit]
    crashed_runs = [r for r in arm if r["crash"] is not None]
    reached = [r["iterations_to_threshold"] for r in arm if r["iterations_to_threshold"] is not None]
    return {"runs": len(arm), "crashes": len(crashed_runs), "crash_rate": len(crashed_runs) / max(len(arm), 1),
            "crash_reasons": {c: sum(r["crash"] == c for r in arm) for c in sorted({r["crash"] for r in crashed_runs})},
            "reached_threshold": len(reached), "mean_iterations_to_threshold": _mean(reached),
            "mean_final_return": _mean([r["final_return"] for r in arm])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--nan-rate", type=float, default=0.0)
    p.add_argument("--arms", choices=("both", "on", "off"), default="both")
    p.add_argument("--on-aux", type=float, default=TOOLKIT_ON_MOE["aux_loss_coef"],
                   help="load-balancing loss weight of the 'on' arm (ablation)")
    p.add_argument("--on-z", type=float, default=TOOLKIT_ON_MOE["z_loss_coef"], help="z-loss weight of the 'on' arm")
    p.add_argument("--on-router", default="topk", help="router of the 'on' arm (e.g. bias: aux-loss-free balancing)")
    p.add_argument("--on-balance", default="fixed", choices=("fixed", "adaptive"),
                   help="moe.balance of the 'on' arm: adaptive applies the balance loss (up to --on-aux) "
                        "only while the load is outside the healthy band")
    p.add_argument("--json")
    args = p.parse_args()
    TOOLKIT_ON_MOE.update(aux_loss_coef=args.on_aux, z_loss_coef=args.on_z, router=args.on_router,
                          balance=args.on_balance)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs, t0 = [], time.time()
    try:
        for seed in range(args.seeds):
            for toolkit in {"both": (False, True), "on": (True,), "off": (False,)}[args.arms]:
                r = one_run(seed, toolkit, args.iterations, args.nan_rate)
                runs.append(r)
                print(f"seed {seed} toolkit {'on ' if toolkit else 'off'}: crash={r['crash']} "
                      f"to_{THRESHOLD:.0f}={r['iterations_to_threshold']} final={r['final_return']:.1f} "
                      f"skipped={r['skipped_steps']:.0f}  ({time.time() - t0:.0f}s)", flush=True)
    finally:
        ray.shutdown()
    out = {"args": vars(args), "off": summary(runs, False), "on": summary(runs, True), "runs": runs}
    print(json.dumps({k: out[k] for k in ("args", "off", "on")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

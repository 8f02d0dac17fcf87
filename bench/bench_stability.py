"""Stability benchmark: stress settings over many seeds, the stability toolkit off, on, and ablated.

    .venv/bin/python bench/bench_stability.py [--setting cartpole|multitask|tokens] [--seeds 10]
        [--iterations N] [--nan-rate 0.0] [--arms off,on] [--json OUT]

Settings (each made harsh on purpose: a high Adam LR, small batches, many experts):
  cartpole   CartPole-v1, 32 experts top-2 (2 MoE layers, d 64), lr 3e-3, batch 512, minibatch 64,
             6 epochs, 20 iterations; target return 200.
  multitask  moe_rl/MultiTask-v0 (4 tasks, a contextual bandit: return = correct actions of 32,
             random 8), task-conditioned router, 16 experts top-2, lr 1e-2, gamma 0, batch 1024,
             minibatch 128, 6 epochs, 20 iterations; target 24.
  tokens     moe_rl/TokenSequence-v0 (copy an 8-token prompt, vocabulary 4), the transformer trunk,
             16 experts top-2 (2 blocks, d 32), lr 3e-3 (3x configs/tokens.yaml), batch 1000,
             minibatch 125, 4 epochs, 20 iterations; target 0.7 (random: 0.25).
With --nan-rate r, each optimizer step's gradient is made non-finite with probability r on purpose
(the seeds' "ghost" NaN gradients of mixed precision).

Arms are sets of the toolkit's pieces, added to a plain baseline (Adam, no balance or z loss, no
clipping, no skipping):
  off           the baseline alone
  on            moe-rl's recommended toolkit: ON_PIECES below (configs/stable.yaml)
  seeds         the seeds' recipe: SEEDS_PIECES (a fixed balance loss and the z loss, no shared expert)
  on-P, on+P    the recommended toolkit without / with piece P (ablations; chain them: on-P-Q)
Pieces: PIECES below.

A run crashes when (1) any loss is non-finite or the run raises, (2) the router collapses: active
experts < 50% of N or CV > 2 for 5 consecutive iterations, or (3) the return collapses: after reaching
half the target it stays below 30% of its best for the last 3 iterations.
Reported per arm: crash rate, iterations to the target (mean over the runs that reach it, and over
all runs with a run that never reaches it counted as iterations + 1), the final return (mean, std,
min, max over all runs).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402

import moe_rl.envs  # noqa: E402,F401  registers the moe_rl/ envs
from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.algo.results import metrics_row  # noqa: E402

SETTINGS = {
    "cartpole": {"env": "CartPole-v1", "env_config": {}, "lr": 3e-3, "target": 200.0, "iterations": 20,
                 "training": dict(train_batch_size_per_learner=512, minibatch_size=64, num_epochs=6),
                 "moe": dict(num_experts=32, top_k=2, num_layers=2, d_model=64, d_ff=64)},
    "multitask": {"env": "moe_rl/MultiTask-v0", "env_config": {"num_tasks": 4}, "lr": 1e-2, "target": 24.0,
                  "iterations": 20,
                  "training": dict(train_batch_size_per_learner=1024, minibatch_size=128, num_epochs=6,
                                   gamma=0.0, lambda_=1.0),
                  "moe": dict(num_experts=16, top_k=2, num_layers=2, d_model=64, d_ff=64, router="task",
                              router_kwargs={"num_tasks": 4}, task_slice=[8, 4])},
    "tokens": {"env": "moe_rl/TokenSequence-v0",
               "env_config": {"seq_len": 8, "prompt_len": 8, "vocab_size": 4, "task": "copy"},
               "lr": 3e-3, "target": 0.7, "iterations": 20,
               "training": dict(train_batch_size_per_learner=1000, minibatch_size=125, num_epochs=4),
               "moe": dict(num_experts=16, top_k=2, num_layers=2, d_model=32, d_ff=32, num_heads=2,
                           max_seq_len=16, activation="gelu")},
}


def _lr_schedule(group: str, spec):
    def apply(moe, stab, lr):
        stab.setdefault("lr_schedules", {})[group] = spec(lr)
    return apply


# Each piece edits the arm's (moe, stability) settings; lr is the setting's base LR.
PIECES = {
    "adaptive_balance": lambda moe, stab, lr: moe.update(aux_loss_coef=0.05, balance="adaptive"),
    "fixed_balance": lambda moe, stab, lr: moe.update(aux_loss_coef=0.05, balance="fixed"),
    "z_loss": lambda moe, stab, lr: moe.update(z_loss_coef=1e-3),
    "shared_expert": lambda moe, stab, lr: moe.update(shared_expert=True),
    "clip": lambda moe, stab, lr: stab.update(grad_clip=1.0),
    "skip": lambda moe, stab, lr: stab.update(skip_nonfinite=True),
    "winsorize": lambda moe, stab, lr: stab.update(winsorize_p=0.01),
    "router_lr": _lr_schedule("router", lambda lr: {"schedule": "constant", "lr": lr / 10, "warmup_steps": 50}),
    "cosine": _lr_schedule("experts", lambda lr: {"schedule": "cosine", "lr": lr, "eta_min": lr / 10,
                                                  "t_max": 2000}),
}
ON_PIECES = ("adaptive_balance", "shared_expert", "clip", "skip", "winsorize", "router_lr", "cosine")
SEEDS_PIECES = ("fixed_balance", "z_loss", "clip", "skip", "winsorize", "router_lr", "cosine")


def arm_pieces(arm: str):
    """'off', 'on' or 'seeds', then any number of -piece / +piece (e.g. on-router_lr-cosine)."""
    base, *edits = re.split(r"(?=[+-])", arm)
    bases = {"off": (), "on": ON_PIECES, "seeds": SEEDS_PIECES}
    if base not in bases or any(e[1:] not in PIECES for e in edits):
        raise SystemExit(f"--arms: {arm!r} is not off, on or seeds followed by -P / +P with P in {tuple(PIECES)}")
    pieces = list(bases[base])
    for e in edits:
        pieces = [q for q in pieces if q != e[1:]] + ([e[1:]] if e[0] == "+" else [])
    return tuple(pieces)


def config(setting: dict, arm: str, seed: int) -> MoEPPOConfig:
    moe = {**setting["moe"], "aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    # anomaly detection only watches the metrics, so it is off in every arm (it does not change training)
    stab = {"skip_nonfinite": False, "anomaly_detection": False}
    for piece in arm_pieces(arm):
        PIECES[piece](moe, stab, setting["lr"])
    return (MoEPPOConfig().environment(setting["env"], env_config=setting["env_config"])
            .env_runners(num_env_runners=0, num_envs_per_env_runner=4)
            .training(lr=setting["lr"], vf_loss_coeff=0.5, vf_clip_param=1000.0, **setting["training"])
            .moe(**moe).stability(**copy.deepcopy(stab)).debugging(seed=seed))


def nan_injector(rate: float, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def hook(learner, module_id):
        if torch.rand((), generator=gen).item() < rate:
            p = next(p for p in learner.module[module_id].parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")
    return hook


def crashed(rows, num_experts: int, target: float):
    # The return is NaN in an iteration where no episode ended (long CartPole episodes, small
    # batches): that is not a crash, so only losses count as non-finite, and returns are filtered.
    for r in rows:
        if not all(math.isfinite(r.get(k, 0.0)) for k in ("policy_loss", "vf_loss", "aux_loss")):
            return "non-finite"
    bad = 0
    for r in rows:
        bad = bad + 1 if (r["moe/active_experts"] < 0.5 * num_experts or r["moe/cv"] > 2.0) else 0
        if bad >= 5:
            return "router-collapse"
    returns = [r["episode_return_mean"] for r in rows if math.isfinite(r["episode_return_mean"])]
    if (returns and max(returns) >= 0.5 * target and len(returns) >= 3
            and all(v < 0.3 * max(returns) for v in returns[-3:])):
        return "return-collapse"
    return None


def one_run(setting: dict, arm: str, seed: int, iterations: int, nan_rate: float):
    algo = config(setting, arm, seed).build_algo()
    rows, error = [], None
    if nan_rate > 0:
        algo.learner_group.foreach_learner(lambda l: l.grad_hooks.append(nan_injector(nan_rate, seed)))
    try:
        for _ in range(iterations):
            rows.append(metrics_row(algo.train()))
            if crashed(rows, setting["moe"]["num_experts"], setting["target"]) == "non-finite":
                break
    except Exception as e:  # noqa: BLE001  a run that raises is a crash, recorded with its reason
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        algo.stop()
    reason = "exception" if error else crashed(rows, setting["moe"]["num_experts"], setting["target"])
    to_target = next((r["iteration"] for r in rows if r["episode_return_mean"] >= setting["target"]), None)
    return {"seed": seed, "arm": arm, "crash": reason, "error": error, "iterations": len(rows),
            "iterations_to_target": to_target,
            "final_return": next((r["episode_return_mean"] for r in reversed(rows)
                                  if math.isfinite(r["episode_return_mean"])), float("nan")),
            "final_cv": rows[-1]["moe/cv"] if rows else float("nan"),
            "final_active_experts": rows[-1]["moe/active_experts"] if rows else float("nan"),
            "skipped_steps": rows[-1].get("stability/skipped_steps", 0.0) if rows else 0.0,
            "returns": [r["episode_return_mean"] for r in rows], "cv": [r["moe/cv"] for r in rows],
            "active_experts": [r["moe/active_experts"] for r in rows]}


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def summary(runs, arm, iterations):
    """Crash rate; convergence over every run of the arm (a router collapse need not stop learning)."""
    mine = [r for r in runs if r["arm"] == arm]
    crashed_runs = [r for r in mine if r["crash"] is not None]
    reached = _finite([r["iterations_to_target"] for r in mine])
    final = _finite([r["final_return"] for r in mine])
    return {"runs": len(mine), "crashes": len(crashed_runs),
            "crash_reasons": {c: sum(r["crash"] == c for r in mine)
                              for c in sorted({r["crash"] for r in crashed_runs})},
            "reached_target": len(reached),
            "mean_iterations_to_target": statistics.mean(reached) if reached else None,
            "mean_iterations_to_target_censored": statistics.mean(
                [r["iterations_to_target"] or iterations + 1 for r in mine]) if mine else None,
            "final_return_mean": statistics.mean(final) if final else None,
            "final_return_std": statistics.stdev(final) if len(final) > 1 else None,
            "final_return_min": min(final, default=None), "final_return_max": max(final, default=None),
            "skipped_steps": sum(r["skipped_steps"] for r in mine)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--setting", choices=tuple(SETTINGS), default="cartpole")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--iterations", type=int, help="default: the setting's")
    p.add_argument("--nan-rate", type=float, default=0.0)
    p.add_argument("--arms", default="off,on", help="comma-separated: off, on, seeds, on-P, on+P")
    p.add_argument("--json")
    args = p.parse_args()
    setting = SETTINGS[args.setting]
    iterations = args.iterations or setting["iterations"]
    arms = args.arms.split(",")
    for arm in arms:
        arm_pieces(arm)  # fail on a misspelt arm before any run
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=2)
    runs, t0 = [], time.time()
    try:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for arm in arms:
                r = one_run(setting, arm, seed, iterations, args.nan_rate)
                runs.append(r)
                print(f"seed {seed} {arm}: crash={r['crash']} to_target={r['iterations_to_target']} "
                      f"final={r['final_return']:.2f} cv={r['final_cv']:.2f} skipped={r['skipped_steps']:.0f}"
                      f"  ({time.time() - t0:.0f}s)", flush=True)
    finally:
        ray.shutdown()
    out = {"args": {**vars(args), "iterations": iterations, "on_pieces": ON_PIECES},
           "summary": {arm: summary(runs, arm, iterations) for arm in arms}, "runs": runs}
    print(json.dumps({k: out[k] for k in ("args", "summary")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

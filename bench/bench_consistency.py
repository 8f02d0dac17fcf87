"""Consistency-check overhead: the quickstart (CartPole, 8 experts, top-2) with a check before
every weight sync vs. with checks off. Same seeds, same process, same run.

    .venv/bin/python bench/bench_consistency.py [--iterations 12] [--learners 0|2] [--json OUT]

Reports mean wall time per iteration (first iteration excluded) and the overhead share
(t_on - t_off) / t_on; the target is <= 3 %. Also the check's own time as the run records it
(`check_s`, and the sync's `sync_s`, which takes the sync-time digests and the last good state):
the wall-time difference also carries whatever else differs between the two runs.
"""
import argparse
import json
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from moe_rl.app.run_config import load_run_config, validate_run_config  # noqa: E402


def per_iteration(cfg, checks: bool, learners: int, iterations: int):
    cfg = dict(cfg, consistency={"enabled": checks}, learners={"num_learners": learners})
    if learners > 1:
        cfg["moe"] = dict(cfg["moe"], ep_size=learners)
    algo = validate_run_config(cfg).build_algo()
    times, phases = [], []
    try:
        for _ in range(iterations):
            t0 = time.perf_counter()
            result = algo.train()
            times.append(time.perf_counter() - t0)
            phases.append({k: result["moe_rl"].get(k, 0.0) for k in ("check_s", "sync_s")})
    finally:
        algo.stop()
    mean = {k: sum(p[k] for p in phases[1:]) / len(phases[1:]) for k in ("check_s", "sync_s")}
    return sum(times[1:]) / len(times[1:]), mean


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--learners", type=int, default=0, help="0: local learner; 2: DeepSpeed ep_size=2")
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=4)
    cfg = load_run_config()
    # Interleave off/on twice so drift in machine load hits both alike.
    off, on = [], []
    for _ in range(2):
        off.append(per_iteration(cfg, False, args.learners, args.iterations))
        on.append(per_iteration(cfg, True, args.learners, args.iterations))
    ray.shutdown()
    t_off, t_on = sum(t for t, _ in off) / 2, sum(t for t, _ in on) / 2
    phase = {f"{k}_{name}": sum(p[k] for _, p in runs) / 2 for name, runs in (("off", off), ("on", on))
             for k in ("check_s", "sync_s")}
    row = {"learners": args.learners, "iter_s_checks_off": t_off, "iter_s_checks_on": t_on,
           "overhead_share": (t_on - t_off) / t_on, **phase,
           "recorded_share": (phase["check_s_on"] + phase["sync_s_on"] - phase["sync_s_off"]) / t_on}
    print(f"learners={args.learners}: {t_off:.3f} s/iter without checks, {t_on:.3f} s/iter with a check every "
          f"iteration -> overhead {100 * row['overhead_share']:.1f}%; recorded: check_s {phase['check_s_on']:.3f} s, "
          f"sync_s {phase['sync_s_off']:.3f} -> {phase['sync_s_on']:.3f} s -> {100 * row['recorded_share']:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()

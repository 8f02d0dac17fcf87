"""The consistency check's share of an iteration, timed around the gate's calls in one real run,
beside the same run without checks.

    .venv/bin/python bench/bench_check_share.py [--config configs/cartpole.yaml] [--iterations 12] [--set K=V]

Builds the config twice in one Ray, with consistency checks and with `consistency.enabled=false`,
and runs --iterations iterations of each, alternating, after a first one left out (the probe set
is made there). Times, on the driver's thread, the gate's before_update and after_update (the check) and
its sync. What the gate does on its own thread beside the sampling and the update (the rollout
copies' digests, the synced version's digests and last good state, the candidate's trip to the
rollouts) costs the driver only where a later call waits for it, and that wait is inside these
calls. The check's cost: before_update + after_update + (the sync with checks − the sync without),
as a share of the wall time with checks; and, noisier, the two runs' median iteration times.
"""
import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "cartpole.yaml"))
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as moe-rl train --set")
    args = ap.parse_args()
    import ray

    from moe_rl.algo import sync_gate
    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config
    from moe_rl.app.train import start_local_ray
    seconds = {"checks": collections.defaultdict(list), "no checks": collections.defaultdict(list)}
    running = []   # the arm training now

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[running[0]][name].append(time.perf_counter() - t0)
        return call
    for name in ("before_update", "after_update", "sync"):
        setattr(sync_gate.SyncGate, name, timed(name, getattr(sync_gate.SyncGate, name)))
    arms = {"checks": args.set, "no checks": args.set + ["consistency.enabled=false"]}
    configs = {arm: validate_run_config(apply_overrides(load_run_config(args.config), s)) for arm, s in arms.items()}
    # The actors import this checkout's moe_rl too (a worktree of another revision measures it).
    runners = sum(c.num_env_runners for c in configs.values())
    start_local_ray(num_cpus=max(os.cpu_count() or 1, runners + 1), runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    algos = {}
    for arm, config in configs.items():
        running[:] = [arm]
        algos[arm] = config.build_algo()
        algos[arm].train()
    for arm_seconds in seconds.values():
        arm_seconds.clear()
    # The two arms' iterations alternate (and which goes first), so a slower or busier stretch of
    # the machine's time falls on both.
    walls = {arm: [] for arm in algos}
    for i in range(args.iterations):
        for arm in (list(algos) if i % 2 == 0 else list(algos)[::-1]):
            running[:] = [arm]
            t0 = time.perf_counter()
            algos[arm].train()
            walls[arm].append(time.perf_counter() - t0)
    for algo in algos.values():
        algo.stop()
    ray.shutdown()
    runs = {arm: (walls[arm], seconds[arm]) for arm in algos}
    (walls, gate), (walls_off, gate_off) = runs["checks"], runs["no checks"]
    wall = sum(walls)
    print(f"{args.config} {' '.join(args.set)}: {args.iterations} iterations each; median iteration "
          f"{statistics.median(walls):.3f} s with checks, {statistics.median(walls_off):.3f} s without")
    for name in ("before_update", "after_update", "sync"):
        v = gate.get(name, [0.0])
        share = 100 * sum(v) / wall
        print(f"  {name:15s} median {statistics.median(v) * 1e3:7.1f} ms   {share:5.2f} % of the wall time")
    sync_off = gate_off.get("sync", [0.0])
    print(f"  sync without checks median {statistics.median(sync_off) * 1e3:7.1f} ms")
    check = (sum(gate.get("before_update", [])) + sum(gate.get("after_update", []))
             + sum(gate.get("sync", [])) - statistics.fmean(sync_off) * len(gate.get("sync", [])))
    ratio = statistics.median(walls) / statistics.median(walls_off) - 1
    print(f"  the check in all: {100 * check / wall:.2f} % of the wall time "
          f"(median iteration time, checks vs none: {100 * ratio:+.2f} %)")


if __name__ == "__main__":
    main()

"""The consistency check's share of an iteration, timed around the gate's calls in one real run.

    .venv/bin/python bench/bench_check_share.py [--config configs/cartpole.yaml] [--iterations 12] [--set K=V]

Times every call of the gate's before_update and after_update (the check) and the synced version's
digests and the last good state where they are taken outside them, over --iterations iterations
after a first one left out (the probe set is made there), and prints each as a share of the wall
time of those iterations.
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
    seconds = collections.defaultdict(list)
    inside = []   # the gate call running now: what it calls is its time, not a second entry

    def timed(name, fn):
        def call(*a, **k):
            if inside:
                return fn(*a, **k)
            inside.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name].append(time.perf_counter() - t0)
                inside.pop()
        return call
    for name in ("before_update", "after_update"):
        setattr(sync_gate.SyncGate, name, timed(name, getattr(sync_gate.SyncGate, name)))
    config = validate_run_config(apply_overrides(load_run_config(args.config), args.set))
    # The actors import this checkout's moe_rl too (a worktree of another revision measures it).
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1),
                    runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    algo = config.build_algo()
    # What a sync adds for the check (the synced version's digests, the last good state), wherever
    # the code under test takes them: inside a check they are already the check's time.
    for name in ("shard_digests", "snapshot"):
        setattr(algo.learner_group, name, timed(name, getattr(algo.learner_group, name)))
    algo.train()
    seconds.clear()
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        algo.train()
    wall = time.perf_counter() - t0
    algo.stop()
    ray.shutdown()
    print(f"{args.config} {' '.join(args.set)}: {args.iterations} iterations, {wall / args.iterations:.3f} s each")
    for name, v in seconds.items():
        share = 100 * sum(v) / wall
        print(f"  {name:15s} median {statistics.median(v) * 1e3:7.1f} ms   {share:5.2f} % of the wall time")
    check = sum(sum(v) for v in seconds.values())
    print(f"  the check in all: {100 * check / wall:.2f} % of the wall time")


if __name__ == "__main__":
    main()

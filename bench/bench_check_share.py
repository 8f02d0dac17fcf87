"""The consistency check's share of an iteration, timed around the gate's calls in one real run.

    .venv/bin/python bench/bench_check_share.py [--config configs/cartpole.yaml] [--iterations 12]

Times every call of the gate's before_update and after_update (the check) and of what the sync
adds for it (the synced weights' digests and the last good state), over --iterations iterations
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
    args = ap.parse_args()
    import ray

    from moe_rl.algo import sync_gate
    from moe_rl.app.run_config import load_run_config, validate_run_config
    from moe_rl.app.train import start_local_ray
    seconds = collections.defaultdict(list)

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name].append(time.perf_counter() - t0)
        return call
    for name in ("before_update", "after_update", "keep_last_good"):
        setattr(sync_gate.SyncGate, name, timed(name, getattr(sync_gate.SyncGate, name)))
    config = validate_run_config(load_run_config(args.config))
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1))
    algo = config.build_algo()
    algo.learner_group.shard_digests = timed("shard_digests", algo.learner_group.shard_digests)
    algo.train()
    seconds.clear()
    t0 = time.perf_counter()
    for _ in range(args.iterations):
        algo.train()
    wall = time.perf_counter() - t0
    algo.stop()
    ray.shutdown()
    print(f"{args.config}: {args.iterations} iterations, {wall / args.iterations:.3f} s each")
    for name, v in seconds.items():
        share = 100 * sum(v) / wall
        print(f"  {name:15s} median {statistics.median(v) * 1e3:7.1f} ms   {share:5.2f} % of the wall time")
    check = sum(sum(seconds[n]) for n in ("before_update", "after_update", "keep_last_good", "shard_digests"))
    print(f"  the check in all: {100 * check / wall:.2f} % of the wall time")


if __name__ == "__main__":
    main()
